"""The package's version: a leaf module, so the client can name it without importing the
package root (which imports the client)."""

__version__ = "0.1.0"
