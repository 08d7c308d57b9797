"""The Cleave coordinator: a parameter server that trains a model with volunteers' GEMMs."""

from coordinator.job import Job, train_locally

__all__ = ["Job", "train_locally"]
