"""Token ids in, token ids and statistics out: sampling, DRY and bans, draft trees and their three sources, the
context window, the cost curve and the automatic budget, and the engine that verifies trees and commits tokens."""
