"""Merging contributions (weighted mean, RDA), the outer optimizer, acceptance judgement."""
