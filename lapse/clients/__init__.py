"""The I/O edges: one connection helper per system lapse talks to."""
