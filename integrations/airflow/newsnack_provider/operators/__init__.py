"""The newsnack operators."""
