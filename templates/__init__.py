"""slothkit's notebook templates (installed as the data package ``slothkit_templates``).

The ``*.py`` files here are jupytext percent-format notebooks with ``${name}``
placeholders, not modules to import; ``models.json`` holds what differs between
models.  ``slothkit new-notebook MODEL`` renders them (slothkit.notebook.render).
"""
