"""Flyte workflows and launch plans: wiring only."""
