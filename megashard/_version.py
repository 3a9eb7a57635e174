"""megashard's version, in a module of its own: lower layers (checkpoint metadata, the rank agreement) read it
without importing the top-level package."""
__version__ = "0.1.0"
