"""Fold rules for the lpnn family (issue 17): placeholder, filled in with the family."""
