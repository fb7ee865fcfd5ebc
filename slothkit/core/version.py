"""slothkit's version, here so that the ground floor can name it without importing the
package's public face (pyproject.toml states the same number for the wheel)."""

__version__ = "0.1.0"
