"""The engine: the speculative step and everything that schedules it (batch, scheduler, policy, lookup, prefix cache,
sampling) behind the runtime facade."""
