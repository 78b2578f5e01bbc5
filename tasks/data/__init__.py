"""Records the loop stores and reads: prompts, samples, preference pairs, the pair formats a user
imports, the audit queue and labels. Imports tasks.core and tasks.schemas only."""
