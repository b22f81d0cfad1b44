"""`local-testnet`: a whole run as processes on one machine; built with the federated-run issue."""
