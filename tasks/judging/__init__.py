"""The AI judges (lexicon, local LM, HTTP, reward model), their factory, pairwise labelling and
its cache. Imports tasks.reward, tasks.models and the floors below; never tasks.policy."""
