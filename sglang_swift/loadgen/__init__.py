"""Multi-turn load generator for SGLang-compatible servers (chat sessions and agent tool loops)."""
