"""`sao eval`: every Nth policy version scored on held-out tasks, on an engine of its own."""
