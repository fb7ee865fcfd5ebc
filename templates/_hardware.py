# %% Hardware and memory plan
from slothkit.notebook.hardware import hardware_report

config = hardware_report(config)
