"""Discrete-event cluster simulator driving DSec's own decision code in virtual time (docs/simulator.md)."""
