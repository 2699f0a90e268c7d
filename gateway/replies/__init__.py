"""replies"""
