"""The library version (also ``kha_compile.__version__``), written into checkpoints and exports."""

__version__ = "0.1.0"
