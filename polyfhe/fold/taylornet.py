"""Fold rules for the taylornet family (issue 17): placeholder, filled in with the family."""
