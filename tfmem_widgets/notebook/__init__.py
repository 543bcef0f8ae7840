"""The notebook layer: the magics (their parsers, their calls), cell hooks, hazards said before a
cell, the fresh child's shell, widgets.

The only layer that imports IPython or ipywidgets; the core never imports it."""
