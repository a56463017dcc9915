"""eagle3-forensics: find why an EAGLE-3 draft accepts fewer tokens on SGLang than in training."""
__version__ = "0.1.0"
