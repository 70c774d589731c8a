"""Deployment: CTranslate2 export through a parity gate, and the HTTP server."""
