"""The stages, one per notebook: each imports the core, never another stage."""
