"""Operator scripts; each is also installed as a console command."""
