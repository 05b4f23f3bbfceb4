"""kiln.serving"""
