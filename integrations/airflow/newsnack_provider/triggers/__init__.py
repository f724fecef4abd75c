"""The newsnack wait's trigger."""
