"""The floor every other package stands on: errors, atomic writes, JSON Lines, the workspace's
path layout, progress lines, the stage processes' heap. Imports nothing from tasks."""
