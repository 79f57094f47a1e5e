"""Fold rules for the resmlp family (issue 17): placeholder, filled in with the family."""
