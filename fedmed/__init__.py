"""fedmed."""
