"""The package version (one place; the public face re-exports it)."""

VERSION = "0.1.0"
