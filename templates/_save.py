# %% Save and publish (each behind its Config flag)
from slothkit.notebook.saving import save_all

saved = save_all(model, tokenizer, config)
for kind, path in saved.items():
    print(f"{kind:12s} {path}")
