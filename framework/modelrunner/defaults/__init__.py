"""The kernel's own plugins, registered trylast so that any installed plugin overrides them."""
