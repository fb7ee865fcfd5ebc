"""slothkit's notebook templates (installed as the data package ``slothkit_templates``).

The ``*.py`` files here are jupytext percent-format notebooks with ``${name}``
placeholders, not modules to import; ``models.json`` holds what differs between
the notebooks of each model (Hub ids, display name, chat template, T4 batch sizes).
Its keys are shapes named by the architecture records (slothkit.models), which say
everything about the architecture.  ``vision_models.json`` holds the same for the
image-text models of the vision template.  ``slothkit new-notebook MODEL`` renders them
(slothkit.notebook.render).
"""
