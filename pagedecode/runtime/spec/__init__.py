"""Speculative decoding: proposals (n-gram lookup, a draft model, a request's prediction),
verification in the engine's own step (exact matching, or the rejection rule for a draft's
sampled drafts), and the gates that keep it where it pays. The rest of the runtime reads it
through these names only."""
from .prediction import PredictionCursor
from .speculative import SpecCounters, Speculator

__all__ = ["PredictionCursor", "SpecCounters", "Speculator"]
