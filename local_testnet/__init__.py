"""`local-testnet`: a whole run as processes on one machine."""
