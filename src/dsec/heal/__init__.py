"""Healing a data-parallel group in place: who is a member of which epoch (membership.py), and where in the
sequence of collectives a replacement can join (sequence.py). Pure: the control plane and the probe do the I/O."""
