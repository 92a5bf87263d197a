"""Drafters: one per file, behind the :class:`specray.drafters.base.Drafter` protocol."""
