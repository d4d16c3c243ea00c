"""Attention hook: wraps the platform attention backend (never copies it)."""
