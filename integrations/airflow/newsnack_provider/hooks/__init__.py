"""The newsnack hook."""
