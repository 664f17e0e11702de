"""Test helpers shipped with the package: private servers and contract suites."""
