"""Drafter training: data generation, target features, COD sampling, trainer."""
