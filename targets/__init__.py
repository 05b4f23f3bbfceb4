"""kiln.targets"""
