"""The stages, one per notebook: each imports the core, never another stage. Their list (id, notebook, package,
hand-offs, longest wait) is core.values.stagelist, in core because the hand-offs and the records read it too."""
