"""Discrete-event simulation of a Cleave pool, driving the real Scheduler and planners.

`python -m coordinator.sim --help`; docs/simulation.md explains the model and its limits.
"""
