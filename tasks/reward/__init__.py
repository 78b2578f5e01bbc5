"""The Bradley-Terry reward model: its features, training, ensembles and the probe head. Imports
tasks.functional, tasks.models and the floors below."""
