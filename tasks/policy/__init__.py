"""The policy updates: DPO and its family, PPO with its value head, the KL budget. Imports
tasks.reward, tasks.functional, tasks.models and the floors below; never tasks.judging."""
