"""What the loop is measured by: the gold evaluator and its review check, win rates and their
intervals, head-to-head against the champion, the report. Imports tasks.judging and the floors
below."""
