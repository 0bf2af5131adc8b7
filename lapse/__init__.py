"""lapse"""
