"""Integrations of DSec with other systems (agent harnesses, webhooks, native code)."""
