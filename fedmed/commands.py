"""Workflow verbs (data, experiment, demo, assess) are registered here."""


def register(sub):
    return None
