"""Device discovery: vendor plugins, operator declarations, device profiles, inventory."""
