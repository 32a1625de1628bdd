"""Pipeline runtime: schedule IR, passes, validation, simulator and the executor."""
