"""The params: the loader and its checks over tasks/schemas/, profiles and their bases, the
conditions that switch declared deps. Imports tasks.core and tasks.schemas only."""
