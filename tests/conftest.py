"""Fixtures shared by the whole suite."""

pytest_plugins = ["tests.fakenvml.plugin"]
