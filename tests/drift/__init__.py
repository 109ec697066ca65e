"""The drift suite: forks of ``vendored/`` made by code transformations at test time (see README.md)."""
